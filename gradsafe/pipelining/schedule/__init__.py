"""Fixes to torch's pipeline *schedule* classes, apart from the B/W split (private modules only).

``gradsafe.patch("pipelining")`` installs them (``pipelining/_patch.py`` lists
every slot); nothing here is public except what ``gradsafe.pipelining``
re-exports (:class:`~gradsafe.pipelining.MetadataInferenceError`).

* ``_inference.py``: stage metadata inference without side effects (H6).
* ``_scaling.py``: a parameter several stages of one rank share is divided
  once per step (H7).
* ``_stage.py``: the stage call sites gradsafe's W needs changed (a DDP
  stage's inference forward under ``no_sync``; a last stage's view outputs
  kept detached for the merge).
* ``_inference_hazards.py``, ``_scaling_hazards.py``: the doctor's
  reproductions of H6 and H7 (their rows are in ``pipelining/_hazards.py``'s
  ``CHECKS``); ``_one_rank.py``: the one-rank gloo group they run on.
"""
