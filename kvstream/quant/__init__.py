"""FP8 and other wire codecs (see issue 5)."""
