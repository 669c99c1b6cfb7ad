"""A request's life in VeriCache: its record (``record.py``) and the table of records with the
one close path (``table.py``). Plain Python: no torch, no sglang (unit-tested in microseconds);
``srt/context.py`` gives each scheduler one table, and the SGLang-facing parts report to it.
"""
