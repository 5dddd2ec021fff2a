"""What a script outside the package drives the stages with: each stage's config, the Tasks the training loop runs
(stage 1 and stage 2), and stage 2's translated initialisation of E and L. The lab (bench/) uses these names from
here, not from the stages' modules, so the stages may move without it noticing."""
from s2t2_dist.stages.evaluate import EvaluateConfig
from s2t2_dist.stages.finetune import FinetuneConfig, FinetuneTask
from s2t2_dist.stages.init_model import translated_embeddings
from s2t2_dist.stages.translate import TranslateConfig, TranslateTask

__all__ = ["EvaluateConfig", "FinetuneConfig", "FinetuneTask", "TranslateConfig", "TranslateTask",
           "translated_embeddings"]
