"""Recipes: named weight/activation scheme pairs (presets) and the typed plan a recipe resolves to
for one model (plan), made once and consumed by every pipeline."""
