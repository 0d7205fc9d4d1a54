"""Runs the script that follows (train.py and its flags) with rank 1 not seeing the files and folders named in
NANOGRPO_TEST_HIDDEN, in listings or as files: NFS lagging behind another node's view after a quick requeue."""
import os
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
if os.environ.get("RANK") == "1":
    hidden, listdir, isfile = set(os.environ["NANOGRPO_TEST_HIDDEN"].split(",")), os.listdir, os.path.isfile
    os.listdir = lambda path=".": [name for name in listdir(path) if name not in hidden]
    os.path.isfile = lambda path: os.path.basename(path) not in hidden and isfile(path)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
