"""Imported by ``kvdiag_agent.pth`` at interpreter start, only when ``KVDIAG_AGENT=1``: arms the agent.

Never raises: a target must start whatever happens here (one line on stderr says why it is not armed).
"""

from kvdiag.agent.arm import arm_quietly

arm_quietly()
