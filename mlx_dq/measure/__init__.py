"""The measure stage: every option's error per tensor over calibration text, and its files.

``stream.measure`` runs it (its ``head`` stage, one tensor's options in ``tensor`` and ``meter``, ``importance``,
the blocked ``head_kl``, resume state in ``checkpoint``); ``model_kl`` has whole-model KL and ``measure_module``;
``records`` and ``exl2`` read and write measurement files; ``grids`` holds the candidate options.
"""
