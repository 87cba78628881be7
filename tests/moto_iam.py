"""moto_public.py's server, authorising SQS calls as AWS does (tests/test_iam.py runs it with IAM enforced):
moto 5.2.5 names a batch call by its API name (sqs:DeleteMessageBatch), where AWS authorises it as the single
action (sqs:DeleteMessage; the SQS developer guide, "Amazon SQS batch actions"), and takes GetQueueUrl's queue
from a QueueUrl it does not have (so its resource is "*", which no queue ARN matches). Test-only, moto's gaps."""
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


def queue_name(self):
    return (self._get_param("QueueName") if self._get_action() == "GetQueueUrl"
            else named(self))


named = SQSResponse._get_queue_name
access_control.IAMRequestBase.check_action_permitted = check_action_permitted
SQSResponse._get_queue_name = queue_name

if __name__ == "__main__":
    moto_public.main()
