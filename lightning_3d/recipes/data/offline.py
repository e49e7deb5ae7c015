"""The Hugging Face libraries' offline switches, scoped to the recipes' reading of local files.

``datasets.load_dataset`` on a packaged builder ("text", "json", ...) with local ``data_files`` still contacts the
network unless offline mode is on: it sends a HEAD request to the datasets' download counter on a cloud storage host
(``datasets.load.increase_load_count``), and would resolve Hub names. The recipes promise no network contact unless a
download is asked for (``allow_download=True`` with a Hub name), so their local reads run inside
:func:`local_files_only`, which turns ``datasets``' and ``huggingface_hub``'s offline flags on for the call and
restores them after: a user who asks for the Hub elsewhere in the same process still reaches it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def local_files_only() -> Iterator[None]:
    """``datasets`` and ``huggingface_hub`` offline (no download counter, no Hub lookup) for the ``with`` block."""
    import datasets.config
    import huggingface_hub.constants

    switches = [(datasets.config, "HF_HUB_OFFLINE", True), (datasets.config, "HF_DATASETS_OFFLINE", True),
                (datasets.config, "HF_UPDATE_DOWNLOAD_COUNTS", False),
                (huggingface_hub.constants, "HF_HUB_OFFLINE", True)]
    saved = [(module, name, getattr(module, name)) for module, name, _ in switches if hasattr(module, name)]
    try:
        for module, name, value in switches:
            if hasattr(module, name):
                setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
