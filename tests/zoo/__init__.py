"""The architecture zoo: one tiny model per architecture family a user may bring (issue 12).

``tests/zoo/models.py`` holds the specs, ``tests/zoo/survey.py`` compiles and verifies each one in
its own process, ``tests/test_zoo.py`` keeps them working.
"""
