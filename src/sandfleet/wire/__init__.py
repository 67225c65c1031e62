"""Wire models and errors shared by every component."""
