"""Editor sessions replayed against the completion server: `replay` (llama.vim's requests every few lines),
`typist` (llama.vim's or llama.vscode's client key by key, on a simulated clock), `clients` (those two clients,
emulated from their source) and `mat` (a recorded session's drafting replayed offline, no model).

    .venv/bin/python -m tools.editor.replay --help
"""
