"""A lost learner rank is said in Tandem's words: the cause in a few words from Ray's own exceptions (their classes
and the messages Ray writes for each death), and `LearnerLost` is a TandemError a Python caller can catch."""

import pytest
import ray.exceptions as rex

import tandem
from tandem.core.actor_names import death_cause


@pytest.mark.parametrize("error,cause", [
    (rex.ActorDiedError(), "its process died"),  # Ray's default text: "The actor died unexpectedly before ..."
    (rex.RayActorError(error_msg="The actor died because its node has died. Node Id: 40a2f1"), "its node died"),
    (rex.RayActorError(error_msg="The actor is dead because its worker process has died. Worker exit type: "
                                 "UNEXPECTED_SYSTEM_EXIT"), "its process died"),
    (rex.ActorUnavailableError("RpcError: failed to connect, rpc_code: 14", b"\x01" * 16),
     "unreachable: its node or process does not answer"),
    (rex.RayActorError(error_msg="The actor ran out of patience"), "The actor ran out of patience"),
])
def test_a_learners_death_is_said_in_a_few_words(error, cause):
    assert death_cause(error) == cause, str(error)


def test_learner_lost_is_a_tandem_error_exported_from_tandem():
    assert issubclass(tandem.LearnerLost, tandem.TrainingError) and issubclass(tandem.LearnerLost, tandem.TandemError)
    with pytest.raises(tandem.TandemError, match="learner rank 1"):
        raise tandem.LearnerLost("learner rank 1 on node h (10.0.0.2, Ray node 40a2f1) lost (its node died)")
