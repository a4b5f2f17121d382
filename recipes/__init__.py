"""The shipped recipes, as package data: `specdraft recipes` lists them (see specdraft/recipe_files.py)."""
