"""Records, ArrayRecord shards, curation and the grain loader (docs/architecture.md § Contracts; TOPR §4.3 and App. D, FPA App. B.1).

    Record / RecordError / validate_record        data.records
    ShardWriter / write_records / RecordSource    data.shards   (manifest.json + shards)
    BatchLoader / LoaderOptions / make_loader     data.loader   (-> data.batch.Batch)
    loader_from_config / packing_options          data.loader   (from an ExperimentConfig)
    collate_packed                                data.loader   (data.pack: segment-id rows)
    group_units / pack_batches / group_counts     data.units    (records, pairs, whole groups)
    stage_input / stage_output / check_mu         data.stages   (which directory a stage reads)
    Batch / records_view / token_record_mask      data.batch    (packed per-record layout)
    select / curate_directory / transform_rewards data.curation
"""
