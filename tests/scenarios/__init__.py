"""Scenario programs run in N processes by tests/launch.py. Each process prints the Python stacks of all its threads
shortly before the launcher's deadline (``L3D_STACKS_AFTER_S``), so a scenario that hangs shows where every rank
waited. A watchdog thread, not a signal handler: Lightning resets every signal's handler when a fit ends."""

import faulthandler
import os

if os.environ.get("L3D_STACKS_AFTER_S"):
    faulthandler.dump_traceback_later(float(os.environ["L3D_STACKS_AFTER_S"]), exit=False)
