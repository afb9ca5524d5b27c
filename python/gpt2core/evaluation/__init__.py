"""How good a model is: validation loss and bits per byte, HellaSwag (evaluate, and its command line), DCLM's CORE
(core_eval), lm-evaluation-harness's model class (lm_eval) and the span scoring they share (scoring)."""
