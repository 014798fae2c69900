"""The modulation memo: an exact, byte-bounded LRU of Qwen-Image's modulation tensors (``cache``), what it keys
on (``keys``: weight signatures, numerical settings) and the time-embedding key (``time_embedding``). A new memo key
goes here."""
