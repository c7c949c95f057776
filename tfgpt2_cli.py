"""The `tfgpt2` console script (`[project.scripts]`): `tfgpt2.cli.main`. Importing the package
from here keeps TensorFlow's start-up lines off the terminal (`tfgpt2._startup`)."""
import sys


def main():
    from tfgpt2.cli.main import main as run
    return run()


if __name__ == "__main__":
    sys.exit(main())
