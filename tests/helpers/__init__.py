"""Test helpers: `runs` (train.py and tools as subprocesses), `tiny_data` (tiny sources and
tokenizers), `doc_mask` (document-mask models), `checkpoints`, `job_scripts`, `mesh`, `tiny_llama` (RL), and the
torchrun worker scripts.

No module here may share a name with a project package (data, launch, ...): a worker script
run as `python tests/helpers/x.py` has this folder first on sys.path, so `import data` would
find the helper instead of the package (tests/unit/test_layers.py checks)."""
