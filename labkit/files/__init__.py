"""The lab's files: where shipped data and the cache are (shipped.py), and the files a user names (textfile.py)."""
