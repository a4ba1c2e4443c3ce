"""`maximus ui`: plan, train, stop, resume, chat and export in the browser (Flask; loopback by default).

`maximus.ui.app.create_app` builds the app from one blueprint per page or API area
(`maximus.ui.routes`); `maximus.ui.command.ui_main` serves it; `maximus.ui.guard` is the one
guard every request passes (token, origin, host, run names), and it confines what a browser's
config may name through `maximus.ui.confine`; `maximus.ui.jobs` runs the `maximus-train` /
`maximus export` children; `maximus.ui.chat` serves base | tuned generations; `maximus.ui.form`
builds the run form from the config schema; `maximus.ui.runs` reads run directories without
writing into them; `maximus.ui.exports` lists a run's exports.
"""
