"""`make deploy ENV=<env>`: one environment, from its own account, to an endpoint answering decisions.

What runs in order (``deploy.__main__``): the CDK bootstrap if the account/region has none; the environment's
shared and image stacks; the DLC digest looked up from its tag (unless config pins one); the adapter image built by
CodeBuild and waited for (``deploy.image``), or found already built; the model uploaded to the bucket when
``model_prefix`` holds none (``deploy.model``); every stack of the environment pinned to that digest; one decision
through InvokeEndpoint that must name the digest just deployed (``deploy.smoke``). Why the image is built before
the stacks and not by a custom resource: docs/explanation/image.md.

Needs boto3, the CDK app and its CLI, and the operator tools without llama.cpp (``make deploy-setup``).
"""


class DeployError(Exception):
    """A step failed; the message says which, why, and where to look (a CodeBuild log, a stack)."""
