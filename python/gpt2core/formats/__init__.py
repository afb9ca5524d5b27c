"""Files a run reads and writes: llm.c's model files (llmc), checkpoints and their manifest (checkpoint),
pretrained / Hugging Face weights (pretrained), atomic writes (atomic) and the folder lock (runlock).

Depends on: the top-level modules (config, cli, errors) and _C. Never on the model, training or serving."""
