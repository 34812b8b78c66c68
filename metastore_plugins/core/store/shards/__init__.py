"""Shards and the journal that lists them: a shard file's header, encodings, writing, safe reading and
record checks; each rank's manifest and index journal, their entries and the index read from them.
"""
