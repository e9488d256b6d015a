"""Test helpers: `runs` (train.py and tools as subprocesses), `data` (tiny sources and
tokenizers), `doc_mask` (document-mask models), and the torchrun worker scripts."""
