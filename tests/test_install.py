"""The install recipe's xds-protos fix: the OTLP exporter and the ext_proc stubs import together."""


def test_otlp_exporter_and_ext_proc_stubs_import_together():
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert external_processor_pb2_grpc.ExternalProcessorServicer
    assert OTLPSpanExporter and InstrumentationScope.DESCRIPTOR.name == "InstrumentationScope"


def test_cli_lists_subcommands(capsys):
    from astrolabe.cli import main

    assert main([]) == 2
    assert main(["nope"]) == 2
    out = capsys.readouterr()
    for name in ("extproc", "emulator", "envoy", "demo"):
        assert name in out.out
