"""`kfit-ps run`: a supervisor that keeps a parameter-server job alive through task losses."""

from kfit_ps.launch.config import LaunchConfig
from kfit_ps.launch.events import TaskExit
from kfit_ps.launch.policy import Action, Decision, RestartPolicy
from kfit_ps.launch.supervisor import Supervisor, run

__all__ = ["Action", "Decision", "LaunchConfig", "RestartPolicy", "Supervisor", "TaskExit", "run"]
