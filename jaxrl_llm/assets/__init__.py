"""Small task files written for this project (not copied from any dataset)."""
