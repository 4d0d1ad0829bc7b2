"""Tests may fix the noise key (reproducible floods); production code refuses a fixed key without this."""
import os
import sys

os.environ.setdefault("AEGIS_ALLOW_FIXED_KEY", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests import their shared helpers (families)
