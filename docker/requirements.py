"""Print the requirements of an image from pyproject.toml alone: the build backend, the dependencies and the
named extras. The images install these in a layer of their own, before the sources are copied, so that a
change to the code rebuilds only the small layer that installs mhaserve itself.

    python3 requirements.py pyproject.toml export > requirements.txt
"""

import sys

import tomllib

path, *extras = sys.argv[1:]
with open(path, "rb") as file:
    pyproject = tomllib.load(file)
project = pyproject["project"]
print(*pyproject["build-system"]["requires"], *project["dependencies"], sep="\n")
for extra in extras:
    print(*project["optional-dependencies"][extra], sep="\n")
