"""``python -m hycoc.cli``: the same app as the ``hycoc`` console script."""

from hycoc.cli import app

if __name__ == "__main__":
    app()
