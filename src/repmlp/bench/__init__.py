"""Measuring models: timing, throughput, parameter and MAC counts, the paper's tables and its FC3 figure.

- :mod:`.throughput`: training-time and deployed forms side by side (``repmlp bench``);
- :mod:`.counts`: parameters and multiply-accumulates as the paper counts them (``repmlp.profile``);
- :mod:`.tables` and :mod:`.speed_tables`: the paper's tables of counts and of speed (``repmlp tables``);
- :mod:`.viz`: the paper's FC3 weight figure (``repmlp viz``).

May import :mod:`repmlp.deploy`, :mod:`repmlp.engine` (it measures what they produce) and the folders below
them; nothing above (tasks, commands).
"""
