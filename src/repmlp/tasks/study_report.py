"""study.md and study.png of ``repmlp study ablation`` (placeholder filled below)."""
