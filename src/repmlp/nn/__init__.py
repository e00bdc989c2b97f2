"""repmlp.nn."""
