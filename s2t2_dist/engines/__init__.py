"""Training engines: one interface over plain torch, DeepSpeed ZeRO and FSDP2 (see base.Engine)."""
