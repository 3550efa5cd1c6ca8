"""The data-cleaning benchmark: tools/clean_data.py on a labelled English and Chinese corpus."""
