"""Jinja templates of the generated pipeline package (installed as ``autopipe.templates``)."""
