"""`aiayn serve`, the translation server: a pipeline of four rooms, arrows pointing down.

    cli.py        flags, checkpoint, socket, uvicorn (the `aiayn serve` subcommand)
    app.py        the HTTP app: handlers validate and enqueue, never touch the model
    scheduler.py  the queue and the one model thread that cuts batches from it
    batch.py      what the model thread does with one batch (search, subwords, attention)
    static/       the page (plain HTML/JS/CSS)

Nothing is imported here, so `aiayn.serve.batch` does not pull in the web framework.
"""
