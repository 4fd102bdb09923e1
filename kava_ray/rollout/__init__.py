"""What a training step consumes, and the engines that sample it: the teachers' KV feed (`feed`),
the rank's step sources on fixed data (`step_source`) and on the student's own samples
(`onpolicy_source`), and the sampling engines on-policy draws from (`engines`: the student on HF or
vLLM, a teacher's `generate`; `vllm_engine`). No actors here: these are the student-side clients of
the actors in `actors/`, which host `vllm_engine` for a vLLM teacher."""
