"""Where eval's scripts find the rest of the repository. Importing this puts
eval/ itself, client/python (the kvrope package), examples/ (llama.py) and
tests/python (procs.py, the process helpers the tests share) at the front of
sys.path, each once. HERE is eval/, ROOT the repository.

A script in eval/ finds this module because Python puts the script's folder
first on sys.path; a test adds eval/ before importing from it.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

for p in (HERE, os.path.join(ROOT, "client", "python"), os.path.join(ROOT, "examples"),
          os.path.join(ROOT, "tests", "python")):
    if p not in sys.path:
        sys.path.insert(0, p)
