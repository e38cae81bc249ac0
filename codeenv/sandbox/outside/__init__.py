"""The worker's end of each program in a jail (`codeenv.sandbox.inside`), module for module:
`process` (nsjail and its zygote: launch, control socket, end), `call_io` (a call's fds, output and
reports), `calls` (a call jail), `submission` (a judged call's channel), `families` (a session jail
and a family's socket). Each end imports its channel's facts from `inside.protocol`."""
