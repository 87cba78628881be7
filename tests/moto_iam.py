"""moto_public.py's server, authorising SQS calls as AWS does (tests/test_iam.py runs it with IAM enforced):
moto 5.2.5 names a batch call by its API name (sqs:DeleteMessageBatch), where AWS authorises it as the single
action (sqs:DeleteMessage; the SQS developer guide, "Amazon SQS batch actions"), and gives a call on a queue it
does not have (GetQueueUrl's, one deleted) the resource "*", which no queue ARN matches. Test-only, moto's gaps."""
import os
import sys

from moto.iam import access_control
from moto.sqs.responses import SQSResponse

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moto_public  # noqa: E402  (its AMI parameter; then moto's main)

BATCH = {"sqs:DeleteMessageBatch": "sqs:DeleteMessage", "sqs:SendMessageBatch": "sqs:SendMessage",
         "sqs:ChangeMessageVisibilityBatch": "sqs:ChangeMessageVisibility"}
checked = access_control.IAMRequestBase.check_action_permitted


def check_action_permitted(self, resource):
    self._action = BATCH.get(self._action, self._action)
    return checked(self, resource)


def queue_arn(self):
    """The queue's ARN from its name, as AWS authorises a call, whether the queue exists or not (moto: "*")."""
    name = self._get_param("QueueName") if self._get_action() == "GetQueueUrl" else self._get_queue_name()
    return f"arn:aws:sqs:{self.region}:{self.current_account}:{name}"


access_control.IAMRequestBase.check_action_permitted = check_action_permitted
SQSResponse._determine_resource = queue_arn

if __name__ == "__main__":
    moto_public.main()
