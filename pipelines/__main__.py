"""``python -m tracefp4.pipelines``: the ``tracefp4`` command (what ``make run`` runs)."""

from tracefp4.pipelines import main

main()
