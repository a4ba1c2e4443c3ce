"""`maximus ui`: the planner and live runs in the browser (Flask app, read-only, loopback by default).

`maximus.ui.app.create_app(runs_dir, token=None)` builds the app; `maximus.ui.command.ui_main`
serves it; `maximus.ui.runs` reads run directories without writing into them.
"""
