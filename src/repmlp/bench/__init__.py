"""Measuring models: timing, throughput (``repmlp bench``), parameter and MAC counts, the paper's tables
(``repmlp tables``) and its FC3 figure (``repmlp viz``). May import :mod:`repmlp.deploy`, :mod:`repmlp.engine`
(it measures what they produce) and the folders below them; nothing above (tasks, commands).
"""
