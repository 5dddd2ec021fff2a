"""The translator: the trainable module C -> P -> (E', L') (module.py) and the step-size policy of C (schedule.py)."""
from s2t2_dist.translator.module import (
    FREEZE_LIVE_COLS,
    KINDS,
    NORMALIZATIONS,
    TokenTranslator,
    translated_rows,
    translation_weights,
)
from s2t2_dist.translator.schedule import (
    DEFAULT_STEP,
    FREEZE_LR_X_V,
    PAPER_LR,
    RECIPES,
    StepRecipe,
    freeze_warning,
    resolve_step,
    step_unit,
)

__all__ = [
    "FREEZE_LIVE_COLS", "KINDS", "NORMALIZATIONS", "TokenTranslator", "translated_rows", "translation_weights",
    "DEFAULT_STEP", "FREEZE_LR_X_V", "PAPER_LR", "RECIPES", "StepRecipe", "freeze_warning", "resolve_step",
    "step_unit",
]
