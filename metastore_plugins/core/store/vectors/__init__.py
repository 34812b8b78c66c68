"""Files of vectors derived from the shards: the nearest-gradient index's files, their checks and part
maps, and the sketch cache (bytes only: no FAISS, no queries).
"""
