"""Data for causal-LM and seq2seq training: packed real text (offline by default), span corruption, (input,
target) pairs and synthetic tokens.

Importing this package does not import ``datasets``; only reading data files does.
"""

from lightning_3d.recipes.data.causal_lm import CausalLMDataModule
from lightning_3d.recipes.data.corpus import build_python_docs_corpus
from lightning_3d.recipes.data.loader import ResumableDataLoader, ResumableDistributedSampler
from lightning_3d.recipes.data.seq2seq import Seq2SeqDataModule
from lightning_3d.recipes.data.synthetic import SyntheticLMDataModule, SyntheticSeq2SeqDataModule
from lightning_3d.recipes.data.tokenizer import load_tokenizer

__all__ = [
    "CausalLMDataModule",
    "ResumableDataLoader",
    "ResumableDistributedSampler",
    "Seq2SeqDataModule",
    "SyntheticLMDataModule",
    "SyntheticSeq2SeqDataModule",
    "build_python_docs_corpus",
    "load_tokenizer",
]
