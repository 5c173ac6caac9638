"""A shim: `python -m dynamo_ppd.router`, the relay router's old module path, still starts it.

Deployments written before the move (container commands, Helm values, graphs) name this path. The
relay router is `dynamo_ppd.relay`; its routing state is `dynamo_ppd.routing`. Nothing imports this
package.
"""
