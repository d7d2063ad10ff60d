"""Model sources (HF folders, hub ids, GGUF) and streaming a model one decoder layer at a time."""
