// Command otelcol is the minimal OpenTelemetry Collector the tracing tests send spans to: the OTLP
// receiver (HTTP and gRPC) and the file exporter (one JSON document per export, read back by
// warmserve/testing/otel.py), nothing else. Built by hack/testbin/build.sh at the versions pinned
// in go.mod/go.sum.
//
// It is what the collector's builder (ocb) would generate for those two components, written out
// by hand so that no builder has to be installed; the collector's own telemetry (metrics and
// traces about itself) is left out, so it opens no port beyond the receiver's and logs to stderr.
package main

import (
	"context"
	"log"

	"github.com/open-telemetry/opentelemetry-collector-contrib/exporter/fileexporter"
	"go.opentelemetry.io/collector/component"
	"go.opentelemetry.io/collector/confmap"
	"go.opentelemetry.io/collector/confmap/provider/envprovider"
	"go.opentelemetry.io/collector/confmap/provider/fileprovider"
	"go.opentelemetry.io/collector/exporter"
	"go.opentelemetry.io/collector/otelcol"
	"go.opentelemetry.io/collector/receiver"
	"go.opentelemetry.io/collector/receiver/otlpreceiver"
	"go.opentelemetry.io/collector/service/telemetry"
	"go.uber.org/zap"
)

// version is stamped by build.sh (-X main.version=...).
var version = "dev"

// telemetryConfig is the (empty) `service.telemetry` section: this collector reports nothing
// about itself.
type telemetryConfig struct{}

func components() (otelcol.Factories, error) {
	receivers, err := otelcol.MakeFactoryMap[receiver.Factory](otlpreceiver.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	exporters, err := otelcol.MakeFactoryMap[exporter.Factory](fileexporter.NewFactory())
	if err != nil {
		return otelcol.Factories{}, err
	}
	return otelcol.Factories{
		Receivers: receivers,
		Exporters: exporters,
		// Logs to stderr (the test fixture keeps them); no meter or tracer provider (no-op).
		Telemetry: telemetry.NewFactory(
			func() component.Config { return &telemetryConfig{} },
			telemetry.WithCreateLogger(func(
				_ context.Context, set telemetry.LoggerSettings, _ component.Config,
			) (*zap.Logger, component.ShutdownFunc, error) {
				cfg := zap.NewProductionConfig()
				cfg.Encoding = "console"
				build := set.BuildZapLogger
				if build == nil {
					build = func(c zap.Config, opts ...zap.Option) (*zap.Logger, error) {
						return c.Build(opts...)
					}
				}
				logger, err := build(cfg)
				if err != nil {
					return nil, nil, err
				}
				return logger, func(context.Context) error { _ = logger.Sync(); return nil }, nil
			}),
		),
	}, nil
}

func main() {
	settings := otelcol.CollectorSettings{
		BuildInfo: component.BuildInfo{
			Command:     "otelcol",
			Description: "warmserve test collector (OTLP receiver, file exporter)",
			Version:     version,
		},
		Factories: components,
		ConfigProviderSettings: otelcol.ConfigProviderSettings{
			ResolverSettings: confmap.ResolverSettings{
				// file: for --config, env: for ${VAR} in it (the collector's default scheme).
				ProviderFactories: []confmap.ProviderFactory{
					fileprovider.NewFactory(), envprovider.NewFactory(),
				},
			},
		},
	}
	if err := otelcol.NewCommand(settings).Execute(); err != nil {
		log.Fatal(err)
	}
}
