"""The measure stage: every option's error per tensor over calibration text, and its files."""
