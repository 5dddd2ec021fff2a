"""The translator: the trainable module C -> P -> (E', L') (module.py), how C becomes P per kind with every
per-kind fact (kinds.py), the recipe that resolves a run's settings and builds the module (recipe.py), P's
statistics (stats.py) and P's file format (pfile.py, imported on its own: the module does not read files)."""
from s2t2_dist.translator.module import (
    NORMALIZATIONS,
    TokenTranslator,
    translated_rows,
    translation_weights,
)
from s2t2_dist.translator.recipe import Resolved, TranslateOptimConfig, TranslatorConfig, freeze_warning
from s2t2_dist.translator.stats import FREEZE_LIVE_COLS, PStats

__all__ = [
    "FREEZE_LIVE_COLS", "NORMALIZATIONS", "PStats", "Resolved", "TokenTranslator", "TranslateOptimConfig",
    "TranslatorConfig", "freeze_warning", "translated_rows", "translation_weights",
]
