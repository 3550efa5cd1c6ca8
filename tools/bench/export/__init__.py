"""The export benchmark: peak host memory of tools/export_hf.py."""
