"""The modulation memo (``cache``), what it keys on (``keys``) and the time-embedding key (``time_embedding``)."""
