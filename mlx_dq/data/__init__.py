"""The bundled calibration and evaluation text, and reading it into token rows."""
